/**
 * Section "crowd": a client that varies its startup parameters makes a pool key of each login (120
 * logins from 127.0.0.2, each with an application_name of its own, each running SELECT 1), and
 * keep-warm would keep a backend of each. Another user's 40 sessions at once, each running
 * pg_sleep(0.2) from its login to its end, are timed on a fresh proxy (their own figure), right after
 * the attack (the pool full of the attacker's idle backends), and once the attacker's are past
 * --pool-idle-timeout (what keep-warm keeps). Target: p50 within 1.5x of its own, no errors.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { startChildProxy } from '../test/support/child-proxy'
import { PASSWORD } from '../test/support/stack'
import { ms, percentile, printTable, type Row, type Section } from './lib'

const ATTACK_LOGINS = 120
const SESSIONS = 40
const IDLE_MS = 1000
const FLAGS = ['--max-sessions', '1000', '--max-sessions-per-ip', '500', '--max-logins-per-ip', '64', '--shutdown-grace', '0', '--pool-idle-timeout', String(IDLE_MS)]

class FromAttacker extends WebSocket {
  constructor(url: string, protocols?: string | string[]) {
    super(url, protocols, { localAddress: '127.0.0.2' })
  }
}

export const crowd: Section = {
  name: 'crowd',
  async run(ctx) {
    const { host, port, database } = ctx.pg
    const config = (url: string, user: string, extra: object = {}) => ({ host, port, database, user, password: PASSWORD, webSocketConstructor: WebSocket as any, wsProxy: () => url, ...extra })
    /** The other user's sessions at once: each one's time from connect to end, and its errors. */
    const victims = async (url: string) => {
      const times: number[] = []
      const errors: string[] = []
      await Promise.all(Array.from({ length: SESSIONS }, async () => {
        const c = new Client(config(url, 'md5_user') as any)
        const t0 = performance.now()
        try {
          await c.connect()
          await c.query('SELECT pg_sleep(0.2)')
          times.push(performance.now() - t0)
        } catch (err) {
          errors.push(`${(err as { code?: string }).code ?? ''} ${(err as Error).message}`)
        } finally {
          await c.end().catch(() => {})
        }
      }))
      return { p50: times.length ? percentile(times, 50) : NaN, errors }
    }
    const attack = async (url: string) => {
      for (let i = 0; i < ATTACK_LOGINS; i += 10) {
        await Promise.all(Array.from({ length: 10 }, async (_, j) => {
          const c = new Client(config(url, 'scram_user', { webSocketConstructor: FromAttacker, application_name: `bench-crowd-${i + j}` }) as any)
          await c.connect()
          await c.query('SELECT 1')
          await c.end()
        }))
      }
    }
    const upstream = `${host}:${port}`
    const measure = async (name: string, before?: (url: string) => Promise<void>) => {
      const p = await startChildProxy(upstream, { built: true, flags: FLAGS })
      try {
        await victims(p.url) // (the other user's key known, as before any attack: its lender made)
        await sleep(IDLE_MS + 500) // (its backends past the idle timeout, but the one kept warm)
        await before?.(p.url)
        return { name, ...(await victims(p.url)) }
      } finally {
        await p.stop()
      }
    }
    const own = await measure('no attack')
    const after = await measure(`right after ${ATTACK_LOGINS} keys`, attack)
    const kept = await measure(`${ATTACK_LOGINS} keys past the idle timeout`, async (url) => (await attack(url), await sleep(IDLE_MS * 2)))
    const rows: Row[] = [after, kept].map((r) => ({
      metric: `another user's ${SESSIONS} sessions, p50 (${r.name}; errors ${r.errors.length})`,
      edgepg: ms(r.p50),
      baseline: ms(own.p50),
      ratio: r.errors.length ? Infinity : r.p50 / own.p50,
      target: 1.5,
    }))
    printTable('Keys that crowd the pool: 120 logins with distinct application_name from one client, then another user', rows, 'no attack', [
      `Own figure errors: ${own.errors.length}. Errors under attack: ${[...after.errors, ...kept.errors].slice(0, 3).join('; ') || 'none'}.`,
    ])
    return rows
  },
}
