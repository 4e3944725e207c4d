"""A test cluster on one machine: hosts as network namespaces with sshd (see netns.py)."""

from cluster.netns import Cluster, ClusterUnavailable, list_clusters, reap_stale, teardown, unavailable_reason

__all__ = ["Cluster", "ClusterUnavailable", "list_clusters", "reap_stale", "teardown", "unavailable_reason"]
