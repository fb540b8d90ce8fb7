"""What several test modules share: multi-process runs (dist), the attention oracle
(attention), the test services (services: Slurm, Prometheus, the Kubernetes API server), the
real CRDs' schemas (crd), the CLI against the Slurm cluster (slurm_jobs), shell checks
(shell) and promtool (promtool). Test modules import from here, never from each other."""
