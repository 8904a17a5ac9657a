"""The kubelet stage: the device plugin API's wire, servers, registration and the pools' runtimes."""
