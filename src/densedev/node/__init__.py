"""The node stage: what sysfs shows, what netlink says, and what the node's kubelet says its pods hold.

Every later stage may read these and none of them imports a later stage: the PodResources client and
the kubelet checkpoint reader (``holdings``) and the inotify directory watch (``watch``) sit here
because the pools' ownership map and the kubelet-facing servers both read them.
"""
