// Command echo is the exec floor for the plugin benchmark: the least a
// chained plugin can do, reading its config and printing prevResult.
package main

import (
	"encoding/json"
	"io"
	"os"
)

func main() {
	data, _ := io.ReadAll(os.Stdin)
	var conf struct {
		PrevResult json.RawMessage `json:"prevResult"`
	}
	json.Unmarshal(data, &conf)
	os.Stdout.Write(conf.PrevResult)
}
