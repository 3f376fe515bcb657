//go:build e2e

package e2e

import (
	"testing"
	"time"

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
