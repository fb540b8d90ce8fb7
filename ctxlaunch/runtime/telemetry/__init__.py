"""Telemetry: the metric contract, the per-rank Prometheus exporter, the Grafana dashboard."""
