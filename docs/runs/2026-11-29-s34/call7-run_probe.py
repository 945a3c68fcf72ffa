import sys
sys.path.insert(0, ".")
from evaluator.remote import Worker
sys.path.insert(0, "probe")
import probe_engine
try:
    probe_engine.create_engine({}, "", "cuda")
except RuntimeError as e:
    print("in-process", e)
with Worker("cuda", log=lambda line: None) as w:
    w.request({"op": "load", "engine": w.readable("probe/probe_engine.py")}, what="import")
    try:
        w.request({"op": "create", "config": {}, "weight_dir": "", "device": "cuda"}, what="create")
    except Exception as e:
        print("worker", str(e)[-600:])
