"""Ray deployment of pdserve: worker actors for the prefill/decode/colocated pools, the controller
that owns pool membership (health, replacement, scaling, draining), and the `pdserve` command
line (`pdserve serve | scale | status | bench`). See deploy/README.md."""
