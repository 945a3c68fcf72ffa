import json, secrets, statistics, time
import torch


def create_engine(config, weight_dir, device):
    counts = [128] * 4
    payload = torch.randint(0, 4096, (512,), dtype=torch.int64).numpy().tobytes()
    res = {}

    def step(n, f):
        torch.cuda.synchronize()
        t = time.perf_counter()
        v = f()
        torch.cuda.synchronize()
        res.setdefault(n, []).append((time.perf_counter() - t) * 1e6)
        return v

    p = torch.empty(512, dtype=torch.int64).pin_memory()
    for _ in range(30):
        h = step("frombuffer", lambda: torch.frombuffer(bytearray(payload), dtype=torch.int64))
        k = step("keys", lambda: [secrets.randbits(62) for _ in counts])
        kt = step("tensor", lambda: torch.tensor(k, dtype=torch.int64))
        m = step("repeat", lambda: torch.repeat_interleave(kt, torch.tensor(counts, dtype=torch.int64)))
        x = step("xor", lambda: h ^ m)
        d = step("todev", lambda: x.to("cuda"))
        step("todev_pinned", lambda: d.copy_(p, non_blocking=True))
        step("of", lambda: d[:128] ^ k[0])
        step("cpu", lambda: d.cpu())
        step("cpu_pinned", lambda: p.copy_(d, non_blocking=True))
        step("empty", lambda: None)
    raise RuntimeError(json.dumps({n: round(statistics.median(v), 1) for n, v in res.items()}))
