//go:build e2e

package e2e

import (
	"testing"
	"time"

	"github.com/inpod-dev/inpod/deviceplugin"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// The soak excuses missing listeners only for a moment when no stand-in
// held the workload: an upgrade's old stand-in stopping after the new one
// acked the snapshot's Add leaves no such moment.
func TestE2ESoakJudgeHeldGap(t *testing.T) {
	at := func(s int) time.Time { return time.Unix(1000+int64(s), 0) }
	ack := func(s int) ztunnel.RecordEntry {
		return ztunnel.RecordEntry{Time: at(s), Event: "ack", UID: "u", NetNS: "4:1"}
	}
	ev := func(s int, event string) ztunnel.RecordEntry { return ztunnel.RecordEntry{Time: at(s), Event: event} }
	del := ztunnel.RecordEntry{Time: at(6), Event: "del", UID: "u"}
	otherAck := ztunnel.RecordEntry{Time: at(1), Event: "ack", UID: "other", NetNS: "4:2"}
	cases := []struct {
		name    string
		records map[string][]ztunnel.RecordEntry
		gap     bool
	}{
		{"held throughout", map[string][]ztunnel.RecordEntry{"a": {ev(0, "start"), ack(1)}}, false},
		{"its stand-in stopped, none other", map[string][]ztunnel.RecordEntry{"a": {ev(0, "start"), ack(1), ev(5, "stop")}}, true},
		{"its stand-in restarted", map[string][]ztunnel.RecordEntry{"a": {ev(0, "start"), ack(1), ev(5, "start")}}, true},
		{"deleted", map[string][]ztunnel.RecordEntry{"a": {ev(0, "start"), ack(1), del}}, true},
		{"stopped after the window", map[string][]ztunnel.RecordEntry{"a": {ev(0, "start"), ack(1), ev(20, "stop")}}, false},
		{"upgrade: the new one acked before the old one stopped", map[string][]ztunnel.RecordEntry{
			"old": {ev(0, "start"), ack(1), ev(5, "stop")},
			"new": {ev(3, "start"), ack(4)}}, false},
		{"upgrade with a gap: the new one acked after the old one stopped", map[string][]ztunnel.RecordEntry{
			"old": {ev(0, "start"), ack(1), ev(5, "stop")},
			"new": {ev(7, "start"), ack(8)}}, true},
		{"restarted and acked again: the first process's end is covered", map[string][]ztunnel.RecordEntry{
			"a": {ev(0, "start"), ack(1), ev(5, "start"), ack(5)}}, false},
		{"restarted, acked again, then that one stopped", map[string][]ztunnel.RecordEntry{
			"a": {ev(0, "start"), ack(1), ev(5, "start"), ack(5), ev(8, "stop")}}, true},
		{"another stand-in's stop or another pod's ack excuses nothing", map[string][]ztunnel.RecordEntry{
			"a": {ev(0, "start"), ack(1)},
			"b": {ev(0, "start"), otherAck, ev(5, "stop")}}, false},
	}
	for _, c := range cases {
		if got := heldGap(c.records, "u", "4:1", at(1), at(10)); got != c.gap {
			t.Errorf("%s: gap %v, want %v", c.name, got, c.gap)
		}
	}
}

// A Del judged against the ack the app started under: a sandbox torn down
// after its ADD and created again (same netns inode number, reused) is
// held again before the app's start; one deleted after that ack is not.
func TestE2ESoakJudgeDelAfterTheHoldingAck(t *testing.T) {
	at := func(ms int) time.Time { return time.Unix(1000, int64(ms)*int64(time.Millisecond)) }
	ack := func(ms int) ztunnel.RecordEntry {
		return ztunnel.RecordEntry{Time: at(ms), Event: "ack", UID: "u", NetNS: "4:1"}
	}
	del := func(ms int) ztunnel.RecordEntry { return ztunnel.RecordEntry{Time: at(ms), Event: "del", UID: "u"} }
	start := ztunnel.RecordEntry{Time: at(0), Event: "start"}
	appStart, readBy := at(8000), at(8100)
	cases := []struct {
		name    string
		records []ztunnel.RecordEntry
		lost    bool
	}{
		// The CI case: ADD acked, kubelet restart, the runtime's DEL 3 s
		// later, the new sandbox's ADD acked, the app started after.
		{"recreated sandbox, re-acked before the app's start", []ztunnel.RecordEntry{start, ack(100), del(3000), ack(4300)}, false},
		{"deleted after the ack, not re-acked", []ztunnel.RecordEntry{start, ack(100), del(3000)}, true},
		{"deleted during the app's read", []ztunnel.RecordEntry{start, ack(100), del(8050)}, true},
		{"re-acked only after the app's start", []ztunnel.RecordEntry{start, ack(100), del(3000), ack(8050)}, true},
		{"held throughout", []ztunnel.RecordEntry{start, ack(100)}, false},
	}
	for _, c := range cases {
		records := map[string][]ztunnel.RecordEntry{"a": c.records}
		anchor := holdingAck(records, "u", "4:1", appStart)
		if _, lost := delBetween(records, "u", anchor, readBy); lost != c.lost {
			t.Errorf("%s: a Del after the holding ack (%s) %v, want %v", c.name, anchor.Format("05.000"), lost, c.lost)
		}
	}
}

// A flushed pod's missing rules are excused for the repair bound after the
// flush and are a violation after it: whether they never came back, came
// back late, or came back and went again.
func TestE2ESoakJudgeTamperBound(t *testing.T) {
	from := time.Unix(1000, 0)
	const bound = 15 * time.Second
	at := func(ms int) time.Time { return from.Add(time.Duration(ms) * time.Millisecond) }
	run := func(missingUntil, lostFrom, end int) []tamperSample {
		var out []tamperSample
		for ms := 100; ms <= end; ms += 100 {
			out = append(out, tamperSample{at(ms), ms >= missingUntil && (lostFrom == 0 || ms < lostFrom)})
		}
		return out
	}
	cases := []struct {
		name     string
		samples  []tamperSample
		back     time.Duration
		violated bool
	}{
		{"back after 3 s", run(3000, 0, 5000), 3 * time.Second, false},
		{"back just within the bound", run(15000, 0, 17000), 15 * time.Second, false},
		{"back late", run(16000, 0, 18000), 16 * time.Second, true},
		{"never back", run(1<<30, 0, 120000), 0, true},
		{"back, then lost again within the bound: excused", run(2000, 4000, 6000), 2 * time.Second, false},
		{"back, then lost again after the bound", append(run(2000, 0, 15000), tamperSample{at(15500), false}), 2 * time.Second, true},
	}
	for _, c := range cases {
		back, late := tamperVerdict(from, c.samples, bound)
		if back != c.back || !late.IsZero() != c.violated {
			t.Errorf("%s: back after %s, late at %v; want back after %s, violated %v", c.name, back, late, c.back, c.violated)
		}
	}
}

// An admission while the agent reports not ready is the device-plugin
// gate's close when it comes within the close's timeout of the not-ready
// run's start (the devices stay Healthy until the pods bound before are
// admitted); later, the gate did not close; with a ready sample near it,
// it was no not-ready admission at all.
func TestE2ESoakJudgeAdmissionDuringTheGatesClose(t *testing.T) {
	at := func(ms int) time.Time { return time.Unix(1000, int64(ms)*int64(time.Millisecond)) }
	samples := func(notReadyFrom int) []readySample {
		var out []readySample
		for ms := 0; ms <= 20000; ms += 500 {
			v := 1.0
			if ms >= notReadyFrom {
				v = 0
			}
			out = append(out, readySample{at(ms), v})
		}
		return out
	}
	s := samples(5000)
	for _, c := range []struct {
		name string
		at   int
		want admission
	}{
		{"while ready", 2000, admittedReady},
		{"a ready sample within a second", 5400, admittedReady},
		{"1.5 s into the run: the close (the CI soak's case)", 6500, admittedWhileClosing},
		{"at the close's timeout and its second of slack", 5000 + int(deviceplugin.DefaultCloseTimeout/time.Millisecond) + 1000, admittedWhileClosing},
		{"past it: the gate did not close", 5000 + int(deviceplugin.DefaultCloseTimeout/time.Millisecond) + 1500, admittedNotReady},
	} {
		got, since := admissionVerdict(s, at(c.at))
		if got != c.want {
			t.Errorf("%s: verdict %d, want %d (not ready since %s)", c.name, got, c.want, since.Format("15:04:05.000"))
		}
	}
	unreadable := func(s []readySample, fromMS, toMS int) []readySample {
		out := append([]readySample(nil), s...)
		for i := range out {
			if ms := int(out[i].at.Sub(at(0)) / time.Millisecond); ms >= fromMS && ms <= toMS {
				out[i].ready = -1
			}
		}
		return out
	}
	// An unreadable sample inside a not-ready run (a scrape timed out, or
	// the agent frozen) does not restart the run: the kubelet still has
	// the agent's last report.
	if got, since := admissionVerdict(unreadable(s, 6000, 6000), at(13000)); got != admittedNotReady || !since.Equal(at(5000)) {
		t.Errorf("an unreadable sample within the run: verdict %d since %s, want not ready since 5 s", got, since)
	}
	// The agent not ready for long, then away just before the admission:
	// still a gate that did not close.
	if got, since := admissionVerdict(unreadable(s, 12000, 13000), at(13200)); got != admittedNotReady || !since.Equal(at(5000)) {
		t.Errorf("not ready for 7 s, then away at the admission: verdict %d since %s, want not ready since 5 s", got, since)
	}
	// The CI soak's case: the agent ready, then away (unreadable) up to
	// the moment the kubelet had the pod, not ready only after: the
	// kubelet went by the last report it had, ready. Once the agent has
	// reported not ready, its report counts again.
	away := unreadable(samples(5000), 3000, 5000)
	if got, _ := admissionVerdict(away, at(5200)); got != admittedBeforeReport {
		t.Errorf("ready, then away until just before the first not-ready sample: verdict %d, want %d", got, admittedBeforeReport)
	}
	if got, since := admissionVerdict(away, at(5500+int(deviceplugin.DefaultCloseTimeout/time.Millisecond)+1500)); got != admittedNotReady || !since.Equal(at(5500)) {
		t.Errorf("after the agent's first not-ready sample, past the close: verdict %d since %s, want not ready since 5.5 s", got, since)
	}
	// The scrapes stalled after a ready sample: the last report the judge
	// read was ready.
	var stalled []readySample
	for _, r := range samples(5000) {
		if ms := int(r.at.Sub(at(0)) / time.Millisecond); ms <= 2000 || ms >= 5500 {
			stalled = append(stalled, r)
		}
	}
	if got, _ := admissionVerdict(stalled, at(5200)); got != admittedBeforeReport {
		t.Errorf("a stall after a ready sample: verdict %d, want %d", got, admittedBeforeReport)
	}
}
