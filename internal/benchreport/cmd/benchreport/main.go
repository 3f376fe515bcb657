// Command benchreport turns the figures make bench collected (see package
// benchreport) into the Markdown report: it prints it and writes it to
// -out. With -update, the figures' sections replace theirs in an existing
// report instead (make bench-scale), the rest of it kept.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/inpod-dev/inpod/internal/benchreport"
)

func main() {
	in := flag.String("in", "", "the figures file the benchmarks appended to (INPOD_BENCH_REPORT)")
	out := flag.String("out", "", "write the Markdown report here as well as to stdout")
	update := flag.String("update", "", "replace the figures' sections in this existing report (adding any it lacks) instead of writing a whole one; -by names the make target for the provenance line")
	by := flag.String("by", "make bench", "what measured the figures, for the provenance line")
	flag.Parse()
	if err := run(*in, *out, *update, *by); err != nil {
		fmt.Fprintln(os.Stderr, "benchreport:", err)
		os.Exit(1)
	}
}

func run(in, out, update, by string) error {
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
	provenance := fmt.Sprintf("Measured by `%s` on %s (%d cores, %s/%s), %s.", by,
		hostname(), runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, time.Now().UTC().Format("2006-01-02"))
	if update != "" {
		doc, err := os.ReadFile(update)
		if err != nil {
			return err
		}
		// The part's own title goes; its provenance goes into each of its
		// sections, as the report's closing line speaks for the rest.
		part := buf.String()
		part = part[strings.Index(part, "\n## ")+1:]
		part = strings.ReplaceAll(strings.TrimRight(part, "\n")+"\n", "\n\n## ", "\n\n_"+provenance+"_\n\n## ") + "\n_" + provenance + "_\n"
		os.Stdout.WriteString(part)
		return os.WriteFile(update, []byte(benchreport.Splice(string(doc), part)), 0o644)
	}
	fmt.Fprintf(&buf, "\n%s Each floor is measured in the same run as its figure.\n", provenance)
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
