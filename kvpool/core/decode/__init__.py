"""A decode shard's policy: its KV pages, its receive regions, its running batch.

Owns which page ids are free, where prefill writes a request's KV, admission
and batching of decode requests with their stop rules, and stop strings over
streamed text.
"""
