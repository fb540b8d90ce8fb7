"""How a job launches: the template contexts, rendering, job records, sweeps, reports and the
backends."""
