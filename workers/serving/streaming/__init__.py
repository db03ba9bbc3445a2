"""Token streaming: deltas coalesced per job, sent through a relay process that owns their producer."""
