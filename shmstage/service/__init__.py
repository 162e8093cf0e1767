"""The node service (issue 22): ``shmstage serve`` owns the store, stages for every user
reading as each caller, and holds leases for the callers' processes (keeper.py); the CLI and
the loader are its clients (api.py), or run in-process when no service answers.
protocol.py: the wire; server.py: the service; worker.py: the forked child of one request;
ops.py: what each request does and for whom; client.py: the socket's client end.
"""
