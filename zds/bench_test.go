package zds_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/internal/benchreport"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/zds"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// BenchmarkAddAck measures Add → Ack against the stand-in, which binds real
// listeners in a real pod netns before acking (as ztunnel does), next to a
// baseline measured in the same run: one bare SOCK_SEQPACKET round trip that
// passes an fd and returns a 2-byte reply, the transport's floor.
func BenchmarkAddAck(b *testing.B) {
	pod := netnstest.New(b)
	nsFile := pod.Open(b)
	path := b.TempDir() + "/zt.sock"
	srv, err := zds.NewServer(zds.Config{SocketPath: path, Source: &source{}, Logger: discardLogger()})
	if err != nil {
		b.Fatal(err)
	}
	if err := srv.Listen(); err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go srv.Serve(ctx)
	z := ztunnel.New(ztunnel.Config{SocketPath: path, Logger: discardLogger()})
	go z.Run(ctx)
	testkit.Eventually(b, 10*time.Second, "the stand-in connected", func() bool {
		return srv.State() == (zds.State{Connections: 1, Ready: true})
	})

	baseline := bareRoundTrips(b, int(nsFile.Fd()), max(b.N, 200))
	addTimes := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		uid := fmt.Sprintf("uid-%d", i)
		start := time.Now()
		if err := srv.Add(ctx, podWorkload(uid, nsFile)); err != nil {
			b.Fatal(err)
		}
		addTimes = append(addTimes, time.Since(start))
		b.StopTimer()
		if err := srv.Del(ctx, uid); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.StopTimer()
	// What the stand-in itself spends per Add, as ztunnel would: entering
	// the pod netns and binding its listeners there.
	var binds []time.Duration
	for range max(b.N, 200) {
		start := time.Now()
		release, err := z.BindListeners(nsFile)
		if err != nil {
			b.Fatal(err)
		}
		binds = append(binds, time.Since(start))
		release()
	}
	p50, p99 := benchreport.Percentile(addTimes, 50), benchreport.Percentile(addTimes, 99)
	base50, base99 := benchreport.Percentile(baseline, 50), benchreport.Percentile(baseline, 99)
	b.ReportMetric(float64(p50.Microseconds()), "add-ack-p50-µs")
	b.ReportMetric(float64(p99.Microseconds()), "add-ack-p99-µs")
	b.ReportMetric(benchreport.Us(base50), "bare-roundtrip-p50-µs")
	b.ReportMetric(float64(p50)/float64(base50), "add-ack/bare-ratio")
	const section = "ZDS Add→Ack (stand-in binding real listeners in the pod netns)"
	floor := "bare SOCK_SEQPACKET round trip carrying an fd"
	benchreport.Record(b, benchreport.Figure{Section: section, Name: "Add→Ack p50", Value: benchreport.Us(p50), Unit: "µs",
		FloorName: floor + ", p50", Floor: benchreport.Us(base50), Target: "≤ 200 µs (#19)"})
	benchreport.Record(b, benchreport.Figure{Section: section, Name: "Add→Ack p99", Value: benchreport.Us(p99), Unit: "µs",
		FloorName: floor + ", p99", Floor: benchreport.Us(base99)})
	benchreport.Record(b, benchreport.Figure{Section: section, Name: "of which the stand-in enters the pod netns and binds its listeners (3 ports, each one dual-stack socket as ztunnel binds them), p50",
		Value: benchreport.Us(benchreport.Percentile(binds, 50)), Unit: "µs"})
}

func bareRoundTrips(b *testing.B, fd, n int) []time.Duration {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	go func() {
		buf, oob := make([]byte, zds.MaxMessageSize), make([]byte, unix.CmsgSpace(8))
		for {
			_, oobn, _, _, err := unix.Recvmsg(fds[1], buf, oob, 0)
			if err != nil {
				return
			}
			msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
			for _, m := range msgs {
				got, _ := unix.ParseUnixRights(&m)
				for _, f := range got {
					unix.Close(f)
				}
			}
			if err := unix.Sendmsg(fds[1], []byte{0x0a, 0x00}, nil, nil, 0); err != nil {
				return
			}
		}
	}()
	msg := make([]byte, 64)
	rights := unix.UnixRights(fd)
	reply := make([]byte, zds.MaxMessageSize)
	out := make([]time.Duration, 0, n)
	for range n {
		start := time.Now()
		if err := unix.Sendmsg(fds[0], msg, rights, nil, 0); err != nil {
			b.Fatal(err)
		}
		if _, _, _, _, err := unix.Recvmsg(fds[0], reply, nil, 0); err != nil {
			b.Fatal(err)
		}
		out = append(out, time.Since(start))
	}
	return out
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }
