"""Programs: build, compile, store, run, decide (the compiler's parts; compiler.py wires them)."""
