"""Finding the attention layers of a model ("sites") and where each head's W^Q rows sit:
the site itself and `find_sites` (site.py), the name matchers (discovery.py), sites given
by hand (explicit.py), fused and gated projections (layouts.py), the W^Q check against
its q_module (orientation.py), and layers that never call SDPA (eager_attention.py).

May import: flashwatch.kernels, flashwatch._checks.
"""

from flashwatch.sites.discovery import NoAttentionLayers
from flashwatch.sites.explicit import make_site
from flashwatch.sites.find import find_sites
from flashwatch.sites.site import AttentionSite

__all__ = ["AttentionSite", "NoAttentionLayers", "find_sites", "make_site"]
