"""The GPU tool: `python3 -m scripts.gpu <subcommand>`, one module per subcommand (see __main__)."""
