/**
 * Section "isolation": what deciding isolation costs under transaction pooling. The parser's reading of
 * a statement (proxy/isolation/reader.ts), at first sight and cached, in this process; and the backend's
 * verification (proxy/isolation/verify.ts), in Postgres's time, beside `SELECT 1` and beside
 * `DISCARD ALL` (what session mode runs at each session's end), each over a connection of pg's own.
 */
import pg from 'pg'
import { loadReader, read } from '../proxy/isolation/reader'
import { verificationSql } from '../proxy/isolation/verify'
import { median, printGrid, type Section } from './lib'

const TEXTS = 2000
const ROUNDS = 300

export const isolation: Section = {
  name: 'isolation',
  async run(ctx) {
    await loadReader()
    const statement = (i: number) => `select "id", "name", "email" from "public"."users" where "id" = $1 and "org" = ${i} order by "name" limit $2`
    let t0 = performance.now()
    for (let i = 0; i < TEXTS; i++) read(statement(i))
    const first = ((performance.now() - t0) * 1000) / TEXTS
    t0 = performance.now()
    for (let round = 0; round < 10; round++) for (let i = 0; i < TEXTS; i++) read(statement(i))
    const cached = ((performance.now() - t0) * 1000) / (TEXTS * 10)

    const client = new pg.Client(ctx.pgConfig())
    await client.connect()
    try {
      // As the proxy runs it: prepared once per backend (planned once), then bound and executed.
      const user = String(ctx.pgConfig().user)
      const verify = { name: 'edgepg_bench_verify', text: verificationSql(user) }
      const light = { name: 'edgepg_bench_light', text: verificationSql(user, false) }
      const resets = 'DISCARD SEQUENCES; RESET ALL' // (in the proxy, in one Sync group with the light question, which releases advisory locks itself)
      const resetting = new pg.Client(ctx.pgConfig()) // (DISCARD ALL would drop the prepared verification)
      await resetting.connect()
      const timed = async (sql: string | typeof verify, on = client) => {
        const times: number[] = []
        for (let i = 0; i < ROUNDS; i++) {
          const start = performance.now()
          await on.query(sql)
          times.push(performance.now() - start)
        }
        return median(times)
      }
      // Interleaved, so that a busy moment weighs on each alike.
      const [one, check, lightly, discard] = [[] as number[], [] as number[], [] as number[], [] as number[]]
      for (let i = 0; i < 5; i++) {
        one.push(await timed('SELECT 1'))
        check.push(await timed(verify))
        lightly.push((await timed(light)) + (await timed(resets)))
        discard.push(await timed('DISCARD ALL', resetting))
      }
      await resetting.end()
      const [m1, mv, ml, md] = [median(one), median(check), median(lightly) - median(one), median(discard)]
      printGrid(
        'isolation: what deciding costs (transaction mode)',
        ['what', 'cost'],
        [
          ['reading a statement with the parser, first sight', `${first.toFixed(1)} µs`],
          ['reading it again (cached)', `${cached.toFixed(2)} µs`],
          ['a round trip of SELECT 1 (pg over TCP)', `${(m1 * 1000).toFixed(0)} µs`],
          ['a round trip of the full verification', `${(mv * 1000).toFixed(0)} µs (+${((mv - m1) * 1000).toFixed(0)} µs of Postgres)`],
          ['a round trip of the light verification', `${(ml * 1000).toFixed(0)} µs (+${((ml - m1) * 1000).toFixed(0)} µs of Postgres)`],
          ['a round trip of DISCARD ALL (session mode, per session)', `${(md * 1000).toFixed(0)} µs (+${((md - m1) * 1000).toFixed(0)} µs)`],
        ],
        [
          'The parse runs on the proxy, once per statement text. The full verification runs on the backend after a transaction that was',
          'not plain, the light one after a plain one that touched a relation, a cast or an operator; both behind the client’s answer:',
          'the client waits for neither.',
        ]
      )
      return [
        { metric: 'parse, first sight (µs)', edgepg: first.toFixed(1), baseline: '' },
        { metric: 'full verification, Postgres time (µs)', edgepg: ((mv - m1) * 1000).toFixed(0), baseline: ((md - m1) * 1000).toFixed(0) },
        { metric: 'light verification, Postgres time (µs)', edgepg: ((ml - m1) * 1000).toFixed(0), baseline: ((md - m1) * 1000).toFixed(0) },
      ]
    } finally {
      await client.end()
    }
  },
}
