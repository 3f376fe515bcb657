package testkit

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/containernetworking/cni/libcni"
)

// RuntimeConfig is the network configuration a container runtime would use
// for a new sandbox, found the way containerd and CRI-O find it (libcni's
// listing of the directory, the first file in name order that loads; a
// single-plugin .conf as a list of one), with the file it came from.
func RuntimeConfig(dir string) (*libcni.NetworkConfigList, string, error) {
	files, err := libcni.ConfFiles(dir, []string{".conf", ".conflist", ".json"})
	if err != nil {
		return nil, "", err
	}
	for _, f := range files {
		if strings.HasSuffix(f, ".conflist") {
			if list, err := libcni.ConfListFromFile(f); err == nil {
				return list, f, nil
			}
			continue
		}
		//lint:ignore SA1019 runtimes still read a single-plugin .conf this way (containerd's go-cni)
		conf, err := libcni.ConfFromFile(f)
		if err != nil {
			continue
		}
		//lint:ignore SA1019 as above
		if list, err := libcni.ConfListFromConf(conf); err == nil {
			return list, f, nil
		}
	}
	return nil, "", fmt.Errorf("no valid CNI configuration in %s", dir)
}

// RuntimeChain is RuntimeConfig's file name and its plugins' types, in
// order.
func RuntimeChain(dir string) (file string, types []string, err error) {
	list, path, err := RuntimeConfig(dir)
	if err != nil {
		return "", nil, err
	}
	for _, p := range list.Plugins {
		types = append(types, p.Network.Type)
	}
	return filepath.Base(path), types, nil
}

// RuntimeChainEndsWith says whether the chain a runtime would use for a
// new sandbox ends with the plugin of type last.
func RuntimeChainEndsWith(dir, last string) bool {
	_, types, err := RuntimeChain(dir)
	return err == nil && len(types) > 0 && types[len(types)-1] == last
}
