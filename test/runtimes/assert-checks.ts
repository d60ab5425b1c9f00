/**
 * What every runtime's run of the shared checks (checks.js) must have seen; used by
 * test/runtimes.test.ts and test/browser.test.ts. `context` (e.g. the page's console errors) is
 * appended to each message, so that a failure says what the runtime reported.
 */
import assert from 'node:assert/strict'
import { same } from '../helpers'

export function assertChecks(out: any, runtime: string, context = '') {
  const more = context ? `\n${context}` : ''
  assert.equal(out.globalWebSocket, 'function', `${runtime}: a global WebSocket${more}`)
  assert.equal(out.node, false, `${runtime}: not running under Node${more}`)
  same(out.client, [{ greeting: 'hi', four: 4, who: 'scram_user' }], `${runtime}: Client query${more}`)
  same(out.pool, [{ n: 42 }, { who: 'md5_user' }], `${runtime}: Pool queries${more}`)
  assert.ok(out.pipelined?.authOffload === true, `${runtime}: the proxy selected the auth-offload subprotocol (pipelined connect); got ${JSON.stringify(out.pipelined)}${more}`)
  same(out.pipelined.rows, [{ seven: 7 }], `${runtime}: query sent with the pipelined connect${more}`)
  same(out.http, { template: [{ ten: 10, s: 'a b' }], query: [{ joined: 'edgepg' }] }, `${runtime}: httpSql over POST /sql${more}`)
}
