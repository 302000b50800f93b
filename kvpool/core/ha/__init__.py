"""The master's high availability, decided without I/O: epochs and fencing, a candidate's leadership, what a
client follows, when a new leader opens for lookups. The services run these over etcd and gRPC."""
