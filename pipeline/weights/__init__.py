"""Weight synchronisation: packed buckets (buckets.py) and the channels that carry them (group.py)."""
