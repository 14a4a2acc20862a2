"""Where state and records are kept: block stores (`blocks/`), catalogs (`catalog/`),
the checkpoint store, exports, the turn journal, the disk budget and the state directory.

May import: the leaves, `config` and `state`.
"""
