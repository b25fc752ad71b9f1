"""Every byte that crosses a process boundary: framing, transport, typed records and the links.

- `wire`: msgpack header + raw array frames, authenticated per message (no pickle);
- `transport`: ZeroMQ ROUTER/DEALER endpoints, the run secret, timeouts, drop accounting;
- `record`, `record_schema`: the rollout record and its columnar batch form (wire and disk);
- `messages`: the orchestrator's control records, one typed record per kind;
- `links`: the generator's and the trainer's clients of the orchestrator;
- `codec`: records declared once, decoded by type; the other channels' records beside it
  (`scorer_pool`, `environment`, `worker_status`, `weight_stream`, `journal_entries`).
"""
