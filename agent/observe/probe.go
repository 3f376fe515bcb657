package observe

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/inpod-dev/inpod/internal/unixsock"
)

// ServeProbes answers the kubelet's exec probes of the agent's own
// container (cmd/inpod-probe) on a root-only unix socket at path, until ctx
// ends: /healthz, and /readyz as status says. The agent runs with
// hostNetwork, so its TCP ports are the node's: during a rollout's surge
// the other agent on the node would answer a probe of them.
func ServeProbes(ctx context.Context, log *slog.Logger, path string, status func() (ready bool, why string)) error {
	ln, err := unixsock.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("probe socket: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ok\n")) })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		ready, why := status()
		if !ready {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		w.Write([]byte(why + "\n"))
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	log.Info("answering the container's probes", "socket", path)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case <-ctx.Done():
	case err := <-errc:
		if !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("probe socket: %w", err)
		}
	}
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	srv.Shutdown(sctx)
	return nil
}
