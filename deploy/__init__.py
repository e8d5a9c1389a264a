"""What runs spyre-serve somewhere: ``deploy.fleet`` (``spyre-fleet``: replicas behind
vllm-router on one machine) and the load-test client (``deploy.loadtest``).

The rest of ``deploy/`` is configuration, not Python: ``compose.yaml`` (replicas
behind vllm-router, scraped by Prometheus), ``router/`` (the pinned router and its image),
``nginx/``, ``prometheus/`` and ``k8s/``.
See ``docs/deployment.md``.
"""
