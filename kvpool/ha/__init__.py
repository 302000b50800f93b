"""The master's high availability over etcd: a small etcd v3 client, a candidate's campaign and keep-alive, the
watch that tells clients and stores where the leader is, and store registration. The decisions are the core's
(``kvpool.core.ha``)."""
