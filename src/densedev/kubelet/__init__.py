"""The kubelet stage: the device plugin API's wire, servers and registration."""
