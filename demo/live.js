// Live notifications: a Client that stays connected and LISTENs on a channel, showing each
// notification as it arrives (through transaction pooling, the proxy's one listening backend
// serves it: docs/realtime.md). NOTIFY from the console above, or from anywhere else.
import { Client } from '/dist/index.mjs'

const KEEP = 50

export function live({ connection, wsProxy }) {
  const $ = (sel) => document.querySelector(sel)
  const form = $('#live')
  const list = $('#notifications')
  const state = $('#live-state')
  let client

  const say = (text, listening) => {
    state.textContent = text
    if (listening) form.dataset.listening = listening
    else delete form.dataset.listening
  }

  const show = (cls, ...cells) => {
    const li = document.createElement('li')
    li.className = cls
    for (const [name, text] of cells) li.append(Object.assign(document.createElement('span'), { className: name, textContent: text }))
    list.prepend(li)
    while (list.children.length > KEEP) list.lastChild.remove()
  }

  form.addEventListener('submit', async (e) => {
    e.preventDefault()
    const channel = form.elements.channel.value.trim()
    if (!channel) return
    try {
      if (!client) {
        client = new Client({ ...connection, wsProxy })
        client.on('notification', ({ channel, payload, processId }) => show('notification', ['at', new Date().toLocaleTimeString()], ['channel', channel], ['payload', payload ?? ''], ['pid', processId ? `pid ${processId}` : '']))
        client.on('notice', ({ message }) => show('notice', ['at', new Date().toLocaleTimeString()], ['payload', message]))
        client.on('error', (err) => (say(`Disconnected: ${err.message}`), (client = undefined)))
        await client.connect()
      }
      await client.query(`LISTEN "${channel.replace(/"/g, '""')}"`)
      const { rows } = await client.query('SELECT c FROM pg_listening_channels() c ORDER BY 1')
      say(`Listening on ${rows.map((r) => r.c).join(', ')}: run NOTIFY ${channel}, 'hello' in the console.`, rows.map((r) => r.c).join(','))
    } catch (err) {
      say(`LISTEN failed: ${err.message}`)
    }
  })
}
