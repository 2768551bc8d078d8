"""Engram storage and hashing (MODEL.md §9, EXL3-ENGRAM.md §5): the compressed token map (`token_map`), the
hash constants and per-position row ids (`hashing`), the packed per-rank shard files (`shards`) and the table
reader (`tables`). The layer math that uses the rows is `dsv41.model.engram`."""
