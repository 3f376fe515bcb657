// Command benchreport turns the figures make bench collected (see package
// benchreport) into the Markdown report: it prints it and writes it to
// -out.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"runtime"
	"time"

	"github.com/inpod-dev/inpod/internal/benchreport"
)

func main() {
	in := flag.String("in", "", "the figures file the benchmarks appended to (INPOD_BENCH_REPORT)")
	out := flag.String("out", "", "write the Markdown report here as well as to stdout")
	flag.Parse()
	if err := run(*in, *out); err != nil {
		fmt.Fprintln(os.Stderr, "benchreport:", err)
		os.Exit(1)
	}
}

func run(in, out string) error {
	if in == "" {
		return fmt.Errorf("-in is required")
	}
	f, err := os.Open(in)
	if err != nil {
		return err
	}
	defer f.Close()
	figures, err := benchreport.Read(f)
	if err != nil {
		return fmt.Errorf("%s: %w", in, err)
	}
	if len(figures) == 0 {
		return fmt.Errorf("%s: no figures: did the benchmarks run with %s set?", in, benchreport.EnvFile)
	}
	var buf bytes.Buffer
	if err := benchreport.Render(&buf, "inpod benchmarks", benchreport.HeadlineSection, figures); err != nil {
		return err
	}
	fmt.Fprintf(&buf, "\nMeasured by `make bench` on %s (%d cores, %s/%s), %s. Each floor is measured in the same run as its figure.\n",
		hostname(), runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, time.Now().UTC().Format("2006-01-02"))
	os.Stdout.Write(buf.Bytes())
	if out != "" {
		return os.WriteFile(out, buf.Bytes(), 0o644)
	}
	return nil
}

func hostname() string {
	h, err := os.Hostname()
	if err != nil {
		return "unknown host"
	}
	return h
}
