"""The node service (issue 22): ``shmstage serve`` owns the store, reads sources with the
caller's credentials and holds leases for the callers' processes (keeper.py)."""
