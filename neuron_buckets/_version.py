"""The one version number: the build, ``nb --version``, every manifest and store record read it.

Its own module, so that a stage needs no import of the package front (which names the whole
public API) to learn it: every arrow runs downwards.
"""

__version__ = "0.2.0"
