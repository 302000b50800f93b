"""Stage 0's policy for one prefill pipeline.

Owns the device block table shared by all stages (refcounted, prefix-cached
blocks), the restore plan (device hit, pool hit, compute), a prefill request's
life as pure transitions, the queue in front of the pipeline and the work
estimates it orders by.
"""
