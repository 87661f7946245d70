"""The ground floor: the package's shared data types (``core.meta``'s interned tensor metadata
first) live here, and a module here imports nothing of the package above ``core/`` (the metrics
and the settings at most), so every floor above may import it without closing an import circle
(tools/import_graph.py; docs/design.md, "Import graph")."""
