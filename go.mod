module github.com/inpod-dev/inpod

go 1.26.0

require (
	github.com/google/nftables v0.3.0
	github.com/vishvananda/netlink v1.3.1
	github.com/vishvananda/netns v0.0.5
	golang.org/x/sys v0.50.0
	google.golang.org/protobuf v1.36.12
)

require (
	github.com/google/go-cmp v0.7.0 // indirect
	github.com/mdlayher/netlink v1.7.3-0.20250113171957-fbb4dce95f42 // indirect
	github.com/mdlayher/socket v0.5.0 // indirect
	golang.org/x/net v0.33.0 // indirect
	golang.org/x/sync v0.6.0 // indirect
)
