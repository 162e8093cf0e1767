"""The cache: the policy over several stores.  Which tier a dataset goes to (tiers.py) and
what is evicted to make room for it (makeroom.py); the engine (engine.py) runs it."""
