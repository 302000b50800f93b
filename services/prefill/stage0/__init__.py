"""What stage 0 alone runs: the scheduler in front of the pipeline, its gate, session
prefetch, the restore from the pool, the ends it collects from every stage after a
forward, and the pipeline-wide health. The code every stage runs is in the package
above."""
