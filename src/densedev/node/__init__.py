"""The node stage: what the kernel shows in sysfs and says over netlink."""
