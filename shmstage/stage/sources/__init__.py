"""What a dataset is read from: one small interface (base.py) and one module per kind.

A source lists its tree and fills files; it knows nothing of DEST's store or of how
partial/<name> is built.  ``kinds`` turns what the user typed into a kind and opens it.
"""
