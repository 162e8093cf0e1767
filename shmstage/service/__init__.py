"""The node service (issue 22): ``shmstage serve`` owns the store and stages for every user,
reading as each caller; the CLI and the loader are its clients (api.py), or run in-process
when no service answers.  protocol.py: the wire; server.py: the service; ops.py: what each
request does and for whom; client.py: the socket's client end.
"""
