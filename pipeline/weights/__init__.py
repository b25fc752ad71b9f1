"""Weight synchronisation: bucket layout (bucket_plan.py), packed buckets (buckets.py) and the channels that carry them (group.py)."""
