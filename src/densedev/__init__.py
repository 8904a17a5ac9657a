"""densedev: a Kubernetes device plugin for SR-IOV VFs and RDMA devices at high density."""

__version__ = "0.1.0"
