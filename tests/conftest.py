"""Suite-wide settings. Every process a test starts (workers, routers, Ray's) inherits them.

`PDSERVE_HUGE_PAGES=0`: no transparent-huge-page advice (engine/huge_pages.py). On the 2-vCPU
VMs CI runs on, faulting advised memory costs seconds per GiB, paid again by each of the
hundreds of engines the suite starts; test_huge_pages.py turns it back on where it is tested."""
import os

from engine.huge_pages import HUGE_PAGES_ENV

os.environ.setdefault(HUGE_PAGES_ENV, "0")
