"""What runs spyre-serve somewhere: the load-test client (``deploy.loadtest``).

The rest of ``deploy/`` is configuration, not Python: ``compose.yaml`` (replicas
behind nginx, scraped by Prometheus), ``nginx/``, ``prometheus/`` and ``k8s/``.
See ``docs/deployment.md``.
"""
