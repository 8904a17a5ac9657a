"""The sysfs layout densedev reads: each directory below the sysfs root named once, for Python code.

The scan itself (``_fast`` and its twin) spells these in its own syscalls; everything else that walks or
builds a sysfs tree (pre-flight checks, partial rescans, the simulated node) takes them from here.  Each
is the kernel's driver-core layout (Documentation/ABI/testing/sysfs-bus-pci, sysfs-class-net,
sysfs-class-infiniband): ``bus/<bus>/devices`` and ``class/<class>`` hold relative links into
``devices/``, ``bus/<bus>/drivers/<driver>`` a link per bound device.
"""

from __future__ import annotations

SYSFS_ROOT = "/sys"  # where the kernel's sysfs is mounted: the default root of every scan
PCI_DEVICES = "bus/pci/devices"  # a link per PCI function, named by its address; always present
PCI_DRIVERS = "bus/pci/drivers"  # a directory per PCI driver, a link per function it binds
AUX_DEVICES = "bus/auxiliary/devices"  # auxiliary-bus devices: subfunctions (mlx5_core.sf.N)
AUX_DRIVERS = "bus/auxiliary/drivers"
VDPA_DEVICES = "bus/vdpa/devices"  # vdpaN devices on the functions that carry them
VDPA_DRIVERS = "bus/vdpa/drivers"  # vhost_vdpa, virtio_vdpa
NET_CLASS = "class/net"  # a link per network interface of the host namespace (<if>/operstate)
INFINIBAND_CLASS = "class/infiniband"  # a link per RDMA device (<ibdev>/ports/<n>/state)
INFINIBAND_VERBS_CLASS = "class/infiniband_verbs"  # uverbsN char devices
INFINIBAND_MAD_CLASS = "class/infiniband_mad"  # umadN and issmN char devices
UIO_CLASS = "class/uio"  # uioN of functions bound to a uio driver
IOMMU_GROUPS = "kernel/iommu_groups"  # a directory per IOMMU group, devices/ linking its members
