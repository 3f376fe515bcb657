package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/inpod-dev/inpod/apiaccess"
)

// DefaultPluginServiceAccount is the ServiceAccount, in the agent's
// namespace, whose token the plugin's agent-down check uses.
const DefaultPluginServiceAccount = "inpod-cni"

// Token lifetime and renewal. The check runs only while the agent is down,
// so the token must outlive the agent by as long as an agent can reasonably
// be away (a crash loop, a node drained overnight): a day. The agent renews
// it every hour, so a token left behind by a dead agent still has about 23
// hours. Each is a read-only credential for pods and namespaces in a 0600
// file on the node; the API server caps the lifetime if its
// --service-account-max-token-expiration is lower, and renewal then follows
// a quarter of what was granted.
const (
	pluginTokenLifetime = 24 * time.Hour
	pluginTokenRenewal  = time.Hour
	// After a failed request: retry soon, then back off.
	pluginTokenRetryMin = time.Second
	pluginTokenRetryMax = 2 * time.Minute
)

// tokenRequester is the TokenRequest API of one namespace's ServiceAccounts
// (client.CoreV1().ServiceAccounts(ns)).
type tokenRequester interface {
	CreateToken(ctx context.Context, serviceAccount string, req *authv1.TokenRequest, opts metav1.CreateOptions) (*authv1.TokenRequest, error)
}

// credentialObserver counts what happens to the plugin's token.
type credentialObserver interface {
	PluginTokenRenewed(expires time.Time)
	PluginTokenRenewalFailed()
}

// pluginCredential keeps the API access file of the plugin's agent-down
// check (inpod-cni-apicheck) supplied with a token of the plugin's own
// ServiceAccount, requested through the TokenRequest API. Unlike the
// agent's projected token it is bound to no pod, so it stays valid when the
// agent's pod is deleted (every rolling update), and it carries only the
// plugin's rights (get pods and namespaces), not the agent's.
type pluginCredential struct {
	tokens         tokenRequester
	serviceAccount string // in the namespace tokens serves
	// rest gives the API server's address and CA, as the agent reaches it.
	rest     *rest.Config
	path     string
	label    string // the agent's enrollment label, which the check applies
	log      *slog.Logger
	observer credentialObserver
	now      func() time.Time
	// Zero: the constants above (tests shorten them).
	lifetime, renewal, retryMin, retryMax time.Duration
}

// run renews the token until ctx ends. A failed request never removes or
// spoils the file: the token in it stays usable until it expires, which is
// exactly what the check needs while the agent is away or the API server is
// unreachable. Failures are logged (an error once the file's token has
// expired, since from then on every ADD on the node fails while the agent is
// down) and counted; they retry with backoff.
func (c *pluginCredential) run(ctx context.Context) {
	c.defaults()
	retry := c.retryMin
	for {
		wait := c.renewal
		expires, err := c.renew(ctx)
		switch {
		case err == nil:
			retry = c.retryMin
			if lifetime := expires.Sub(c.now()); lifetime/4 < wait {
				wait = lifetime / 4
			}
			c.observer.PluginTokenRenewed(expires)
			c.log.Debug("renewed the plugin's token", "serviceAccount", c.serviceAccount, "expires", expires)
		case ctx.Err() != nil:
			return
		default:
			c.observer.PluginTokenRenewalFailed()
			wait, retry = retry, min(2*retry, c.retryMax)
			c.logFailure(err)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

func (c *pluginCredential) defaults() {
	if c.now == nil {
		c.now = time.Now
	}
	for _, d := range []struct {
		v   *time.Duration
		def time.Duration
	}{{&c.lifetime, pluginTokenLifetime}, {&c.renewal, pluginTokenRenewal}, {&c.retryMin, pluginTokenRetryMin}, {&c.retryMax, pluginTokenRetryMax}} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
}

func (c *pluginCredential) logFailure(err error) {
	old, rerr := apiaccess.Read(c.path)
	switch {
	case rerr == nil && (old.Expires.IsZero() || c.now().Before(old.Expires)):
		c.log.Warn("could not renew the plugin's token; the access file keeps the current one", "serviceAccount", c.serviceAccount,
			"validUntil", old.Expires, "err", err)
	default:
		c.log.Error("could not get a token for the plugin's agent-down check, and the access file holds no valid one: while the agent is down, every pod's ADD on this node fails",
			"serviceAccount", c.serviceAccount, "file", c.path, "err", err)
	}
}

// renew requests a new token and writes the file with it.
func (c *pluginCredential) renew(ctx context.Context) (expires time.Time, err error) {
	ca := c.rest.CAData
	if len(ca) == 0 && c.rest.CAFile != "" {
		// Re-read each time: a projected CA bundle can change.
		if ca, err = os.ReadFile(c.rest.CAFile); err != nil {
			return time.Time{}, err
		}
	}
	seconds := int64(c.lifetime / time.Second)
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// No BoundObjectRef: a token bound to the agent's pod would die with it.
	tr, err := c.tokens.CreateToken(rctx, c.serviceAccount, &authv1.TokenRequest{
		Spec: authv1.TokenRequestSpec{ExpirationSeconds: &seconds},
	}, metav1.CreateOptions{})
	if err != nil {
		return time.Time{}, fmt.Errorf("token request for ServiceAccount %s: %w", c.serviceAccount, err)
	}
	if tr.Status.Token == "" {
		return time.Time{}, errors.New("token request: the API server returned no token")
	}
	expires = tr.Status.ExpirationTimestamp.Time
	_, err = apiaccess.Write(c.path, &apiaccess.Access{Server: c.rest.Host, CAData: ca, Token: tr.Status.Token,
		Expires: expires.UTC(), EnrollmentLabel: c.label})
	return expires, err
}
