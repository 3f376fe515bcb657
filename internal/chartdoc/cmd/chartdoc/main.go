// Command chartdoc writes a Helm chart's README from its values.yaml,
// values.schema.json, Chart.yaml and README.md.gotmpl (see package
// chartdoc); with -check it writes nothing and fails when the committed
// README is stale. make chart-docs and make check-chart run it.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/inpod-dev/inpod/internal/chartdoc"
)

func main() {
	chart := flag.String("chart", "deploy/helm/inpod", "the chart's directory")
	check := flag.Bool("check", false, "fail when the chart's README.md is not what chartdoc writes, instead of writing it")
	flag.Parse()
	run := chartdoc.Write
	if *check {
		run = chartdoc.Check
	}
	if err := run(*chart); err != nil {
		fmt.Fprintln(os.Stderr, "chartdoc:", err)
		os.Exit(1)
	}
}
