"""Building partial/<name> from a source: the one estimator, the fit, resume and links,
the manifest, tar extraction and the forked copier.  Written once for every source.
"""
