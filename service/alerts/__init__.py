"""Alerts: pure rules and their state machine, stored state, notifications and the dispatcher (outbox)."""
