"""Jobs: claim -> load -> score -> finish under the lease; interrupts, scorers, recording, the purger."""
