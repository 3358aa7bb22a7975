"""How a producer writes: its options (``options``) and its pack writer (``packs``)."""
