"""The decode worker processes a router spawns: image and video decoding and resizing, off the router's event loop."""
