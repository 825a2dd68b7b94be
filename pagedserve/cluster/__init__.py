"""Scale-out on Ray Serve: engine replicas (``replica.py``), the request routers that pick one per
request (``routers.py`` over the Ray-free ``routing_policy.py``), the engine-core client the front end
drives them through (``ray_client.py``, with retry and resume when a replica dies), and the factory
the server's model registry builds them with (``factory.py``). Ray is imported only here."""
